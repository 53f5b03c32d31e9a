# infertap: `docker build -t infertap .` then
#   docker run -p 127.0.0.1:8080:8080 -e INFERTAP_AUTH__OPEN=true infertap
# (an embedded simulated engine answers; pass -e TAOTOKEN_API_KEY=... to proxy TaoToken instead).
# In the container infertap listens on 0.0.0.0, which it refuses without client keys unless told the
# proxy is open on purpose (INFERTAP_AUTH__OPEN=true: safe with the port published on 127.0.0.1 only).
# Published on other interfaces, give it client keys instead:
#   -e INFERTAP_AUTH__KEYS_ENV=INFERTAP_CLIENT_KEYS -e INFERTAP_CLIENT_KEYS=my-app=KEY,...
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY proxy ./proxy
# constraints.txt pins every runtime dependency to the versions CI tested (scripts/pin_constraints.py).
RUN pip install -c constraints.txt . && rm -rf /src

RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin infertap
USER 10001
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["infertap"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
