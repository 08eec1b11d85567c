"""The per-request budget: every limit the gateway answers before anything reaches a worker."""

from __future__ import annotations

from npu_proxy.protocol.config.server import ServerSettings


class RequestLimits(ServerSettings):
    """Limits on what one request may carry, and on what the gateway keeps for requests."""

    # --- limits: each is answered before anything reaches a worker, in the caller's API's
    # error shape (gateway/api/limits.py, gateway/api/request_path.py, gateway/api/embeddings.py).
    # A request body larger than this many bytes is refused with 413, whether it declares its
    # length (Content-Length) or not (chunked). NOTE: 32 MiB is what Anthropic's own Messages
    # API accepts, so every request Claude Code builds (long sessions, pasted screenshots as
    # base64) fits, as does a long RAG prompt; the gateway keeps at most this much of a body.
    max_body_bytes: int = 32 * 1024 * 1024
    # A blob uploaded for /api/create (POST /api/blobs/sha256:<hex>, a GGUF model file) larger
    # than this is refused with 413; blobs stream to disk, so max_body_bytes does not apply.
    # NOTE: 64 GiB takes a 70B model at 4-5 bits per weight; the disk is the other limit.
    max_blob_bytes: int = 64 * 1024 * 1024 * 1024
    # Messages of one chat (after translation: Anthropic's system and each tool_result count
    # as one), tools offered in one request, and the characters of all message texts and the
    # prompt (system included) before tokenizing; a request over one is a 400 naming it.
    # NOTE: 10,000 messages is far more than any context holds; 256 tools is twice OpenAI's
    # own limit (Claude Code with many MCP servers offers over 100); 1,000,000 characters is
    # more than the longest context served (128K tokens is at most ~512K characters of
    # English), yet keeps a multi-megabyte prompt away from the tokenizers.
    max_messages: int = 10_000
    max_tools: int = 256
    max_prompt_chars: int = 1_000_000
    # JSON objects in one request body, counted as its `{` bytes (in strings too) before
    # the body is decoded; a body over it is a 400. NOTE: decoding is the one step that runs
    # before any count can be checked, on the event loop: a 30 MB body of a million empty
    # messages took a second of it and 107 MiB; 250,000 is far beyond any real request
    # (10,000 messages of several parts, 256 tools with their schemas) and a quarter of that.
    max_json_objects: int = 250_000
    # Embeddings: inputs in one request, and characters in one input (400 beyond either).
    max_embed_items: int = 512
    max_embed_chars: int = 100_000
    # Rerank: documents in one request, and characters in the query and in each document.
    max_rerank_documents: int = 1000
    max_rerank_chars: int = 100_000
    # Images in chats (gateway/content/images.py), each checked before anything reaches a worker:
    # its bytes once decoded, its pixels (width x height, read from the header) and the images
    # of one request. NOTE: 20 MiB is Anthropic's own per-image cap when sent through its API
    # (and its base64, 27 MiB, fits max_body_bytes); 40 megapixels takes any phone photo or
    # 4K/5K screenshot, stays under Pillow's decompression-bomb threshold (89 MP), and is what
    # a vlm worker decodes at most (workers/vlm_engine.py MAX_PIXELS: raising this one past it
    # only moves the refusal there); 16 images already fill the context of the small VLMs
    # served here.
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images: int = 16
    # Fetch http(s) image URLs (OpenAI image_url, Responses input_image, Anthropic url
    # sources)? Off: such a URL is a 400 that says so, and only inline images (base64, data:
    # URLs) are taken. On, the gateway fetches them (within image_url_timeout seconds in all,
    # max_image_bytes, at most 5 redirects, only to http(s)); NOTE: it then reaches whatever
    # address a client names (SSRF): turn it on only where that is acceptable.
    image_urls: bool = False
    image_url_timeout: float = 10.0
    # A JSON schema for structured output or a tool's parameters (gateway/content/schema_check.py):
    # its subschemas, counted as they are met, and their nesting; a 400 beyond either.
    # NOTE: checking is linear in the schema's text; 20,000 subschemas is far more than any
    # real schema has (OpenAI's own limit is 5,000 properties, 10 levels), and 64 levels is
    # deeper than XGrammar's compiler is comfortable with anyway.
    max_schema_nodes: int = 20_000
    max_schema_depth: int = 64
    # Characters of a schema's names and literals (property and definition names, string
    # `enum` and `const` values), OpenAI's own structured-output limit: the worker compiles
    # each into its grammar while every stream on it waits (a 256 KiB property name held
    # them ~1 s).
    max_schema_chars: int = 15_000
    # Enum values of a JSON schema, all its `enum`s together (OpenAI's own limit): each is an
    # alternative of the grammar the worker compiles while every stream on it waits (an
    # enum of 200,000 integers held them 8 s).
    max_schema_enum_values: int = 1_000
    # Request bodies being received at once (gateway/http/body_gate.py), counted from the
    # first byte read to the last, after the Host, Origin and key checks; one more is 503
    # with Retry-After before its body is read. A body must keep arriving: a read waiting
    # longer than body_read_timeout seconds for its next chunk ends the request (408).
    # NOTE: 64 bodies of at most max_body_bytes pin at most 2 GiB; one that trickles in
    # holds a slot only body_read_timeout seconds per chunk.
    max_receiving_bodies: int = 64
    body_read_timeout: float = 30.0
    # A refused request's body (401, 403, 413, 503) is read and dropped, up to this many
    # bytes, so its client sees the answer; beyond that the connection is closed.
    max_drain_bytes: int = 64 * 1024 * 1024
    # Responses API (/v1/responses): responses kept for previous_response_id and
    # GET/DELETE /v1/responses/{id} (a request's `store`, true by default as in OpenAI), in the
    # gateway's memory only: at most this many, each for this many seconds, and at most this
    # many bytes of them all (their JSON); the oldest go first. 0 responses = none are kept.
    responses_store_max: int = 1000
    responses_store_ttl: float = 3600.0
    responses_store_max_bytes: int = 256 * 1024 * 1024
    # Speech (POST /v1/audio/transcriptions and /translations, gateway/content/audio.py): an
    # uploaded audio file's bytes (413 beyond) and its length in seconds once decoded (400
    # beyond). NOTE: 25 MiB is OpenAI's own upload limit; 600 s of speech takes Whisper tiny
    # about a minute on 2 CPU cores, well inside inference_timeout.
    max_audio_bytes: int = 25 * 1024 * 1024
    max_audio_seconds: float = 600.0
    # POST /v1/audio/speech: characters of `input` (400 beyond; OpenAI's own limit), and the
    # phonemes espeak-ng makes of them (the tts worker's 400 beyond: 4,096 emoji read by name
    # are some 60,000; text is about one a character). 16,384 is some 20 minutes of speech.
    max_speech_chars: int = 4096
    max_speech_phonemes: int = 16_384
