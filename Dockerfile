# infertap: `docker build -t infertap .` then `docker run -p 8080:8080 infertap`
# (an embedded simulated engine answers; pass -e TAOTOKEN_API_KEY=... to proxy TaoToken instead).
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
