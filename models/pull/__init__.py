"""Pull a model from the Hugging Face hub into the model cache, with progress and resume.

Two steps so callers can answer "not found" before they start streaming progress:
`plan_pull()` resolves the name (models/registry.py) and lists the repository's files with
their sizes and digests (one metadata request: plan.py); `run_pull()` downloads them
(download.py) and installs them into the cache (install.py).

- Files land in `.staging/<folder>/` as `<file>.incomplete` and are renamed when complete;
  the staging folder is renamed into the cache only when every file is verified, together
  with a manifest, so a partial pull is never a model (models/store.py).
- Resume: an interrupted pull leaves its `.incomplete` files; the next pull asks the hub for
  the rest with an HTTP Range request. NOTE: huggingface_hub 2.x deletes its own partial
  files on failure, so the transfer itself is done here, with huggingface_hub's session,
  headers, URLs, metadata and errors. No automatic retry: an interrupted pull fails with a
  message saying to pull again, as `ollama pull` does.
- Verification: every file's size; its sha256 when the hub gives one (LFS files), else its
  git blob id (small files stored in git).
- Only allow-listed files are fetched; no file path may leave the model folder or be a name
  Windows misreads (a device name, a `:` stream, a trailing dot: models/portable.py), and
  both are checked before anything is created.

Never imports OpenVINO: the gateway runs this in a thread.
"""
