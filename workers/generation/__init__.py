"""What the generating engines (batch, serial, vlm) share: the engine base, prompting, the
prompt fitted to the context, the active request's record, detokenizing and sampling."""
