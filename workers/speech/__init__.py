"""Speech workers: the `asr` role (WhisperPipeline) and what builds its embedded model."""
