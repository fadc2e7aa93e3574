"""The executor side: the model over the physical paged KV cache, the forward pass, sampling, and the per-request
buffers that make the step protocol's runs and references work (``engine.step``)."""
