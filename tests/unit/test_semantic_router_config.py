"""The router config: a good file loads; every kind of mistake is refused with the bad
field named, so a broken file stops the gateway at start and a broken edit is refused by
the reload."""

from __future__ import annotations

import pytest

from gateway.semantic_router import config as config_module
from gateway.semantic_router.config import (
    RouterConfigError,
    check_models,
    load_config,
    parse_config,
)

GOOD = """
virtual_models: [auto, smart]
default_route: chat
similarity: {method: centroid, threshold: 0.5}
guards:
  pii: {action: redact, kinds: [email, card], patterns: [{name: ticket, regex: 'T-\\d+'}]}
  jailbreak: {action: block, threshold: 0.8}
routes:
  - {name: code, model: coder, priority: 5, keywords: [python], regex: ['def \\w+'],
     examples: [write a function]}
  - {name: vision, model: vlm, priority: 9, when: {has_images: true, max_prompt_tokens: 4000}}
  - {name: chat, model: talker}
"""


def test_a_good_config():
    c = parse_config(GOOD)
    assert [r.name for r in c.routes] == ["code", "vision", "chat"]
    assert c.route("vision").when.has_images and c.similarity.method == "centroid"
    assert c.guards.pii.patterns[0].name == "ticket"


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (("keywords: [python]", "keywords: [python, '  ']"), "routes[0].keywords"),
        (("regex: ['def \\w+']", "regex: ['def (']"), "routes[0].regex"),
        (("priority: 5", "priority: high"), "routes[0].priority"),
        (("has_images: true", "has_imagez: true"), "routes[1].when.has_imagez"),
        (("default_route: chat", "default_route: nope"), "default_route"),
        (("{name: chat, model: talker}", "{name: code, model: talker}"), "routes: duplicate"),
        (("{name: chat, model: talker}", "{name: chat, model: auto}"), "routes[2].model"),
        (("action: redact", "action: scrub"), "guards.pii.action"),
        (("threshold: 0.8", "threshold: 1.5"), "guards.jailbreak.threshold"),
        (("method: centroid", "method: knn"), "similarity.method"),
        (("name: ticket", "name: 'Bad Name'"), "guards.pii.patterns[0].name"),
    ],
)
def test_mistakes_name_the_field(edit, field):
    old, new = edit
    assert old in GOOD
    with pytest.raises(RouterConfigError) as e:
        parse_config(GOOD.replace(old, new), "router.yaml")
    assert field in str(e.value) and str(e.value).startswith("router.yaml: ")


def test_not_yaml_not_a_mapping_no_routes():
    with pytest.raises(RouterConfigError, match="not valid YAML"):
        parse_config("routes: [")
    with pytest.raises(RouterConfigError, match="mapping"):
        parse_config("- a\n- b\n")
    with pytest.raises(RouterConfigError, match="routes"):
        parse_config("default_route: x\nroutes: []\n")


def test_unreadable_file(tmp_path):
    with pytest.raises(RouterConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_routes_must_name_served_models():
    c = parse_config(GOOD)
    check_models(c, ["coder", "vlm", "talker"])
    with pytest.raises(RouterConfigError, match=r"routes\[1\].model: 'vlm' is not served"):
        check_models(c, ["coder", "talker"])
    with pytest.raises(RouterConfigError, match="virtual_models: 'smart'"):
        check_models(c, ["coder", "vlm", "talker", "smart"])


def test_phone_detection_without_its_extra(monkeypatch):
    monkeypatch.setattr(config_module, "phone_numbers_installed", lambda: False)
    unnamed = parse_config(GOOD.replace("kinds: [email, card], ", ""))
    assert unnamed.guards.pii.kinds == ["email", "card", "iban"]  # what this install detects
    asked = GOOD.replace("kinds: [email, card]", "kinds: [email, phone]")
    with pytest.raises(RouterConfigError, match=r"guards.pii.kinds.*epd-serve\[pii\]"):
        parse_config(asked)
