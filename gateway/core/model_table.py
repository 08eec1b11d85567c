"""Which models the gateway serves, computed afresh from what is true now.

A model is served when a worker runs it (its heartbeat says so; before the first heartbeat,
its configuration), when it is some worker's configured model, when it was pulled into the
model cache, when a `[models]` entry of the config file points at a local path, when it was
made by /api/create, or when it is an alias made by /api/copy. `workers` lists the workers
running it right now; a model with none is loaded by switching a worker to it
(gateway/core/switching.py). A created model over another one (`base`) runs that model's
weights: the workers running the base serve it, and switching loads the base. So does a
created model whose uploaded GGUF is that model's file (`shares`), while that model is served.

`ServedModel` is defined here, where it is built; the router and the switcher import it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from npu_proxy.models.created import CreatedModel
from npu_proxy.models.locate import NotLocated, locate
from npu_proxy.models.registry import (
    ModelSourceMissing,
    alias_table,
    normalize,
)
from npu_proxy.models.store import ModelStore
from npu_proxy.protocol.config import Config, WorkerSpec

if TYPE_CHECKING:
    from npu_proxy.gateway.core.broker import Broker

log = logging.getLogger(__name__)

# A worker role's kind of model; "vlm" is a text-generation model that also takes images.
ROLE_KIND = {"llm": "llm", "npu": "llm", "embed": "embed", "vlm": "vlm", "rerank": "rerank",
             "asr": "asr", "tts": "tts"}
# Each kind as a 400 names it: what the model is, and the API to use it with.
KIND_WHAT = {"llm": ("a text generation model", "chat or generate"),
             "vlm": ("a vision-language model", "chat or generate"),
             "embed": ("an embedding model", "embeddings"),
             "rerank": ("a reranking model", "rerank (POST /v1/rerank)"),
             "asr": ("a speech-recognition model",
                     "audio transcriptions (POST /v1/audio/transcriptions)"),
             "tts": ("a text-to-speech model", "audio speech (POST /v1/audio/speech)")}


@dataclasses.dataclass
class ServedModel:
    name: str
    kind: str  # "llm", "vlm", "embed", "rerank", "asr" or "tts"
    workers: list[str]  # the workers running it now
    # Its file or folder when known without preparing anything ("" otherwise).
    path: str = ""
    # Made by /api/create: its record (system prompt, parameters, ...; models/created.py).
    created: CreatedModel | None = None
    # The model whose weights it runs, when that is another one (a created overlay).
    base: str = ""

    @property
    def runs(self) -> str:
        """The model a worker loads to serve this one."""
        return self.base or self.name


class ModelTable:
    def __init__(self, config: Config, broker: Broker) -> None:
        self.config = config
        self.broker = broker
        self.aliases = alias_table(config.model_aliases)
        self.store = ModelStore(config.model_cache_path())
        # NOTE: the table is rebuilt only when something it is built from changed; building
        # it costs more than a whole HTTP round trip, and every request resolves a model.
        self._built: tuple[object, dict[str, ServedModel]] | None = None
        self.user_paths = {normalize(name): source for name, source in config.models.items()
                           if source.path}

    # --- names ---------------------------------------------------------------------------

    def canonical(self, requested: str) -> str:
        """The served name `requested` stands for: config aliases, then /api/copy aliases."""
        key = normalize(requested)
        # NOTE: a configured alias's target is kept as written (it may be a path); the name
        # it is served under is the normalized one (`x` is `x:latest`).
        name = normalize(self.aliases.get(key, key))
        return self.store.aliases().get(name, name)

    def default_model(self, spec: WorkerSpec) -> str:
        """The configured model a worker returns to when a switched-to one is unloaded."""
        return self.canonical(spec.switched_from or spec.model_name)

    def current_model(self, spec: WorkerSpec) -> str:
        link = self.broker.links.get(spec.name)
        # NOTE: an idle worker's last heartbeat is its previous process's; it starts with
        # its configured model (the supervisor puts a switched one back when unloading it).
        if link is not None and link.heartbeat is not None and not link.idle:
            return self.canonical(link.heartbeat.model)
        return self.canonical(spec.model_name)

    # --- files ---------------------------------------------------------------------------

    def path_of(self, name: str) -> str:
        """The model's file or folder when it can be named without preparing anything."""
        try:
            return str(locate(self.config, name, self.store).path)
        except NotLocated:
            return ""
        except ModelSourceMissing as exc:
            log.warning("%s", exc)
            return ""

    # --- the table -----------------------------------------------------------------------

    def _inputs(self) -> object:
        """Everything models() depends on that can change while the gateway runs."""
        running = []
        for spec in self.config.workers:
            link = self.broker.links.get(spec.name)
            beat = link.heartbeat.model if link is not None and link.heartbeat and \
                not link.idle else None
            running.append((spec.name, spec.enabled, spec.role, spec.model_name,
                            spec.switched_from, beat))
        return (self.store.version(), tuple(running))

    def models(self) -> dict[str, ServedModel]:
        """The served models by name (a fresh dict; do not change the models in it)."""
        inputs = self._inputs()
        if self._built is None or self._built[0] != inputs:
            self._built = (inputs, self._build())
        return dict(self._built[1])

    def _build(self) -> dict[str, ServedModel]:
        table: dict[str, ServedModel] = {}

        def add(name: str, kind: str) -> ServedModel:
            model = table.get(name)
            if model is None:
                model = table[name] = ServedModel(name=name, kind=kind, workers=[])
            return model

        enabled = [spec for spec in self.config.workers if spec.enabled]
        for spec in enabled:
            add(self.current_model(spec), ROLE_KIND[spec.role]).workers.append(spec.name)
        for spec in enabled:
            add(self.default_model(spec), ROLE_KIND[spec.role])
        for manifest in self.store.manifests().values():
            add(manifest.name, manifest.kind)
        for name, source in self.user_paths.items():
            add(name, source.kind or "llm")
        created = self.store.created()
        for record in created.values():
            if not record.blob:
                continue
            add(record.name, record.kind).created = record
        for record in created.values():
            over = record.base or record.shares
            base = table.get(over) if over else None
            if base is None or base.created is not None:
                if record.base:
                    log.warning("created model %s: its base %s is not served", record.name,
                                record.base)
                continue  # NOTE: one that shares weights runs its own blob then
            model = add(record.name, base.kind)
            model.created, model.base = record, base.name
            # NOTE: a worker configured with the created model's own name runs it too.
            model.workers = list(dict.fromkeys([*model.workers, *base.workers]))
        aliases = self.store.aliases()
        for alias, target in aliases.items():
            if target in table and alias not in table:
                add(alias, table[target].kind)
        for model in table.values():
            model.path = self.path_of(aliases.get(model.runs, model.runs))
        return table
