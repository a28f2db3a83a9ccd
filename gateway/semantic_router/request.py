"""What the router sees of a request: its user texts and a few features.

Built from the gateway's chat messages (``{"role", "content"}`` with string content or
``text`` / ``image`` parts) before anything is tokenized: the target model, and so its
tokenizer, is what the router decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4  # the usual English estimate; the router's length bounds say so


@dataclass
class RequestView:
    """One request as the signals and guards read it."""

    # The last user message's text: keywords, regexes, similarity and jailbreak checks.
    text: str
    # Every user message's text, oldest first (PII and jailbreak heuristics).
    user_texts: list[str] = field(default_factory=list)
    has_images: bool = False
    # All message text, in characters (the prompt-length features).
    prompt_chars: int = 0
    tools: bool = False
    json_output: bool = False

    @property
    def prompt_tokens(self) -> int:
        """Estimated prompt tokens (characters / 4, rounded up)."""
        return -(-self.prompt_chars // CHARS_PER_TOKEN)


def message_text(content) -> str:
    """The text of a message's content (string or parts; images skipped)."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return " ".join(
        str(p.get("text", "")) for p in parts if isinstance(p, dict) and p.get("type") == "text"
    )


def _has_image(content) -> bool:
    parts = content if isinstance(content, list) else []
    return any(isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in parts)


def view_of_messages(
    messages: list[dict], *, tools: bool = False, json_output: bool = False, images: int = 0
) -> RequestView:
    """The view of a chat request; ``images``: images sent beside the messages."""
    texts = [(m.get("role"), message_text(m.get("content"))) for m in messages]
    user = [t for role, t in texts if role == "user"]
    last = messages[-1] if messages else {}
    return RequestView(
        text=message_text(last.get("content")) if last.get("role") == "user" else "",
        user_texts=user,
        has_images=images > 0 or any(_has_image(m.get("content")) for m in messages),
        prompt_chars=sum(len(t) for _, t in texts),
        tools=tools,
        json_output=json_output,
    )


def view_of_prompt(prompt: str, images: int = 0) -> RequestView:
    """The view of a text completion: the prompt is the user's text."""
    return RequestView(
        text=prompt, user_texts=[prompt], has_images=images > 0, prompt_chars=len(prompt)
    )
