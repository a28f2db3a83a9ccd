"""Protocol buffer sources (``epd/v1/*.proto``) and generated Python code (``epd_pb``)."""
