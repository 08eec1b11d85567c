"""Everything about models: names, the registry, the store on disk, pulls, conversion,
facts read from model files, and locating a model's files."""
