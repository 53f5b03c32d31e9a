"""`infertap probe` and `infertap compare`: streams to a base URL, TTFT/TPOT statistics, plots."""
