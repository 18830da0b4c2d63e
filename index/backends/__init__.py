"""Where a gallery lives and how it is searched: the index directory (`store`), exact search
under M′ in RAM (`search`), IVF with on-disk inverted lists (`ondisk`), Milvus
(`milvus_store`), and sharded builds (`shard`)."""
