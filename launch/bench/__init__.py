"""``epd bench serve``: a serving benchmark for any OpenAI-compatible base URL.

Modules: ``datasets`` (what to send), ``client`` (one streamed request and its timings),
``load`` (arrival schedule and concurrency cap), ``metrics`` (percentiles and the summary),
``report`` (terminal table and JSON file), ``cli`` (flags and the run). The result file's
schema is documented in ``docs/bench-serve.md``. Nothing here imports torch.
"""
