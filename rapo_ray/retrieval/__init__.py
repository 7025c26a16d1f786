"""Step-trace retrieval: MiniLM embedder, Milvus store, search indexes and the Ray Serve deployment that answers in batches."""
