"""`infertap bench`: infertap's overhead against a direct connection (cli, scenarios, processes, load
generator, upstream, report, OS utilities)."""
