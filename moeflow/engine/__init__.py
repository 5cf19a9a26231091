"""The engine: assembles a model from a checkpoint (:mod:`.build`, :mod:`.loading`) and runs it
(:mod:`.generate`, :mod:`.kv_cache`, :mod:`.sampling`; for a server, :mod:`.continuous` over :mod:`.kv_slots`)."""
