"""Where a gallery lives and how it is searched.  Every backend is a `gallery.Gallery`
answering with `gallery.Hits`: exact search under M′ in RAM over an index directory
(`search`, `store`), IVF with on-disk inverted lists (`ondisk`) and Milvus (`milvus_store`);
`shard` builds an index directory in shards."""
