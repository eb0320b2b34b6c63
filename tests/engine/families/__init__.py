"""Each model family (engine/model/families/<name>) against its reference (testing/references, or the
transformers model on the family's tiny checkpoint): its network, its decoding, its config fields."""
