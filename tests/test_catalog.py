"""The gateway's model catalog keeps each fact by the model's files (issue 45): a chat
template read once is found again, and a model made again under the same name over other
files is read afresh. Pure code: no server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from npu_proxy.gateway.core import catalog as catalog_module
from npu_proxy.gateway.core.catalog import ModelCatalog
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.models.created import CreatedModel

NAME = "made:latest"


def _made(blob: str, at: float) -> ServedModel:
    record = CreatedModel(name=NAME, blob=blob, file="model.gguf", created_at=at)
    return ServedModel(name=NAME, kind="llm", workers=["llm"], path="/cache/created/made.gguf",
                       created=record)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each template read from the files, by the record's blob."""
    seen: list[str] = []

    def read(config: Any, model: ServedModel) -> str:
        assert model.created is not None
        seen.append(model.created.blob)
        return "{{ tools }}" if model.created.blob == "sha256:b" else "{{ messages }}"

    monkeypatch.setattr(catalog_module, "_chat_template", read)
    monkeypatch.setattr(catalog_module, "configured_template", lambda config, name: "")
    return seen


def test_a_template_is_read_once_and_a_name_made_again_is_read_afresh(
        reads: list[str]) -> None:
    cat = ModelCatalog(SimpleNamespace(config=None))  # type: ignore[arg-type]
    first, again = _made("sha256:a", 1.0), _made("sha256:b", 2.0)

    async def run() -> list[str]:
        return [await cat.chat_template(first), await cat.chat_template(first),
                await cat.chat_template(again)]

    assert asyncio.run(run()) == ["{{ messages }}", "{{ messages }}", "{{ tools }}"]
    assert reads == ["sha256:a", "sha256:b"]
    assert asyncio.run(cat.capabilities(again)).native_tools
    assert not asyncio.run(cat.capabilities(first)).native_tools
