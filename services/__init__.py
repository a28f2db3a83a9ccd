"""epd-serve shared runtime: config, bus, engine, models, kernels, tokenization."""

from services.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy: importing `services` (e.g. for the bus) must not load torch and transformers.
    if name == "LLM":
        from services.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from services import outputs

        return getattr(outputs, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
