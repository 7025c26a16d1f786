"""Step-trace retrieval: MiniLM embedder, Milvus store, Ray Serve deployment, buffer builder."""
