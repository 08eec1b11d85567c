"""lm-evaluation-harness against this server (issue 44): its `local-completions` model runs
log-likelihood tasks through /v1/completions, as it runs them against vLLM.

    python bench/lm_eval.py --lm-eval PATH [--model-gguf PATH] [--limit N]

PATH is the `lm_eval` command of a virtual environment holding `lm-eval[api]` (0.4.13 here;
no torch, no Hugging Face tokenizer: `tokenizer_backend=remote` reads this server's
/tokenizer_info and tokenizes through its /tokenize and /detokenize, then sends token-id
prompts with `echo`, `logprobs` 1 and `max_tokens` 1, reading each prompt token's score).
Two custom tasks whose data this script writes (nothing is fetched): `npu_proxy_facts`,
multiple choice (40 one-line questions of general knowledge, four answers each: accuracy
from the answers' log-likelihoods), and `npu_proxy_text`, rolling log-likelihood of a licence
text (word and byte perplexity, bits per byte). The server is the private one bench/peers.py
starts, its llm worker with `prefix_caching = false` (prompt log-probabilities need every
prompt read whole). Prints lm-eval's table and the number of requests it made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import GGUF_MODEL, MODEL, start_private
from perplexity import default_text

# (question, the right answer, three wrong ones): public facts, one line each.
FACTS = [
    ("What is the capital of France?", "Paris", "Rome", "Madrid", "Berlin"),
    ("What is the capital of Japan?", "Tokyo", "Beijing", "Seoul", "Bangkok"),
    ("What is the largest planet of the solar system?", "Jupiter", "Mars", "Venus", "Mercury"),
    ("How many days are in a week?", "seven", "five", "ten", "twelve"),
    ("What is the chemical symbol of gold?", "Au", "Ag", "Fe", "Pb"),
    ("Which animal is known as the king of the jungle?", "the lion", "the mouse",
     "the snail", "the goldfish"),
    ("What color is the sky on a clear day?", "blue", "green", "purple", "brown"),
    ("What do bees make?", "honey", "milk", "silk", "wool"),
    ("What is frozen water called?", "ice", "steam", "sand", "glass"),
    ("How many legs does a spider have?", "eight", "six", "four", "ten"),
    ("Which ocean is the largest?", "the Pacific Ocean", "the Indian Ocean",
     "the Arctic Ocean", "the Southern Ocean"),
    ("What is the boiling point of water at sea level in Celsius?", "100 degrees",
     "50 degrees", "0 degrees", "250 degrees"),
    ("Who wrote Romeo and Juliet?", "William Shakespeare", "Charles Dickens", "Mark Twain",
     "Jane Austen"),
    ("What is the square root of 81?", "9", "7", "8", "11"),
    ("Which planet is known as the red planet?", "Mars", "Saturn", "Neptune", "Uranus"),
    ("What gas do plants take in from the air?", "carbon dioxide", "helium", "neon",
     "hydrogen"),
    ("What is the capital of Italy?", "Rome", "Milan", "Naples", "Venice"),
    ("How many continents are there?", "seven", "three", "nine", "eleven"),
    ("What is the main language spoken in Brazil?", "Portuguese", "Spanish", "French",
     "German"),
    ("Which organ pumps blood through the body?", "the heart", "the liver", "the lungs",
     "the stomach"),
    ("What is 12 times 12?", "144", "124", "112", "154"),
    ("What is the currency of the United Kingdom?", "the pound", "the euro", "the yen",
     "the dollar"),
    ("Which metal is liquid at room temperature?", "mercury", "iron", "copper",
     "aluminium"),
    ("What is the closest star to the Earth?", "the Sun", "Sirius", "Polaris", "Vega"),
    ("How many hours are in a day?", "24", "12", "36", "48"),
    ("What is the capital of Germany?", "Berlin", "Munich", "Hamburg", "Frankfurt"),
    ("What do you call a baby cat?", "a kitten", "a puppy", "a calf", "a foal"),
    ("Which instrument has 88 keys?", "the piano", "the violin", "the flute", "the drum"),
    ("What is the freezing point of water in Celsius?", "0 degrees", "10 degrees",
     "32 degrees", "100 degrees"),
    ("What is the longest river in Africa?", "the Nile", "the Amazon", "the Danube",
     "the Thames"),
    ("Which shape has three sides?", "a triangle", "a square", "a circle", "a hexagon"),
    ("What is the capital of Spain?", "Madrid", "Barcelona", "Lisbon", "Seville"),
    ("Which language is used to style web pages?", "CSS", "SQL", "Fortran", "COBOL"),
    ("What does a thermometer measure?", "temperature", "weight", "distance", "time"),
    ("Which season comes after winter?", "spring", "autumn", "summer", "winter"),
    ("What is 15 plus 27?", "42", "32", "52", "41"),
    ("Which bird is a symbol of peace?", "the dove", "the crow", "the vulture", "the owl"),
    ("What is the hardest natural substance?", "diamond", "gold", "chalk", "wood"),
    ("What is the capital of Canada?", "Ottawa", "Toronto", "Vancouver", "Montreal"),
    ("How many minutes are in an hour?", "60", "100", "30", "90"),
]

# A task over a JSON-lines file of this script's: its name and data, then its own lines.
TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
FACTS_TASK = """\
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
TEXT_TASK = """\
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_tasks(folder: Path, text: str) -> None:
    """The two tasks and their data: each question's answers in a rotating order."""
    with (folder / "facts.jsonl").open("w") as sink:
        for i, (question, right, *wrong) in enumerate(FACTS):
            choices = list(wrong)
            choices.insert(i % 4, right)
            sink.write(json.dumps({"question": question, "choices": choices,
                                   "answer": i % 4}) + "\n")
    # NOTE: the licence in paragraphs of a few hundred words: each is one document.
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.split()) > 40]
    with (folder / "text.jsonl").open("w") as sink:
        for paragraph in paragraphs[:12]:
            sink.write(json.dumps({"text": paragraph}) + "\n")
    for name, body in (("facts", FACTS_TASK), ("text", TEXT_TASK)):
        head = TASK.format(name=f"npu_proxy_{name}", data=folder / f"{name}.jsonl")
        (folder / f"{name}.yaml").write_text(head + body.format())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval", type=Path, required=True, help="the lm_eval command")
    ap.add_argument("--model-gguf", type=Path)
    ap.add_argument("--limit", type=int, help="documents per task (all by default)")
    args = ap.parse_args()
    model = GGUF_MODEL if args.model_gguf else MODEL
    with tempfile.TemporaryDirectory(prefix="npu-proxy-lm-eval-") as tmp:
        root = Path(tmp)
        write_tasks(root, default_text().read_text())
        (root / "server").mkdir()
        server, _, _ = start_private(root / "server", model, args.model_gguf,
                                     {"prefix_caching": False})
        try:
            model_args = ",".join([
                f"model={model}", f"base_url={server.url}/v1/completions",
                "tokenizer_backend=remote", "tokenized_requests=True", "num_concurrent=1",
                "max_retries=1", "timeout=600"])
            argv = [str(args.lm_eval), "--model", "local-completions", "--model_args",
                    model_args, "--tasks", "npu_proxy_facts,npu_proxy_text",
                    "--include_path", str(root), "--output_path", str(root / "out")]
            if args.limit:
                argv += ["--limit", str(args.limit)]
            env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "HF_HOME": str(root / "hf"), "OPENAI_API_KEY": "unused"}
            started = time.perf_counter()
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - started
            print(done.stdout[-4000:])
            if done.returncode != 0:
                raise SystemExit(f"lm_eval exited {done.returncode}:\n{done.stderr[-4000:]}")
            requests = server.log_path.read_text(errors="replace").count(
                "POST /v1/completions 200")
            print(f"lm_eval ran {seconds:.0f} s; this server answered {requests} completions")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
