"""`infertap doctor`: the common prefill/decode faults, read from /metrics (cli, rules, exposition,
sources)."""
