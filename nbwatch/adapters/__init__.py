"""Framework adapters: the Hugging Face Trainer (`hf`, what it takes of transformers'
internals in `hf_internals`) and Lightning (`lightning`), on one base (`base`: the fit in a
background thread, its handle), over the Monitor's port (`nbwatch.monitor.port`). Users import them
as `nbwatch.hf` and `nbwatch.lightning`."""
