"""Generation: the native engine (continuous batching, paged KV cache) and the vLLM backend.

Entry points: ``factory.make_engine(cfg, model_dir)``, ``generate_all.generate_all(engine, requests)``.
"""
