"""ServiceRegistry: which model a request's `model` names, and listeners that follow every model."""

from __future__ import annotations

import pytest

from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry


def service(model_id: str, *aliases: str) -> Service:
    return Service(model_id, None, model_aliases=tuple((a, model_id) for a in aliases))


def test_a_request_names_a_model_by_id_before_any_alias() -> None:
    models = ServiceRegistry([service("big", "gpt-*"), service("gpt-small", "claude-*")])
    assert models.find("big").model_id == "big"
    assert models.find("gpt-4o").model_id == "big"  # the first model whose alias matches
    assert models.find("gpt-small").model_id == "gpt-small"  # its id wins over big's alias
    assert models.find("claude-haiku").model_id == "gpt-small"
    assert models.find("llama") is None
    assert models.describe_ids() == "'big' and 'gpt-small'"
    assert models.default.model_id == "big"


def test_ids_are_unique_and_a_model_can_come_back_under_its_place() -> None:
    models = ServiceRegistry([service("a"), service("b")])
    with pytest.raises(ValueError, match="the model 'a' is served already"):
        models.add(service("a"))
    reloaded = service("a")
    models.replace(reloaded)
    assert models.all()[0] is reloaded and models.ids() == ["a", "b"]
    assert models.remove("a") is reloaded and models.ids() == ["b"]
    assert ServiceRegistry().describe_ids() == "no model"
    with pytest.raises(KeyError):
        models.replace(service("c"))


def test_a_listener_hears_every_model_those_added_or_reloaded_later_too() -> None:
    models = ServiceRegistry([service("a")])
    heard: list[object] = []
    models.listen(heard.append)
    models.add(service("b"))
    reloaded = service("a")
    models.replace(reloaded)
    assert [heard.append in s.request_listeners for s in models.all()] == [True, True]
