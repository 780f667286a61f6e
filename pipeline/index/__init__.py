"""Search over embedding outputs: a FAISS index built from one model's embeddings, and the queries on it."""
