"""Training the embedded model and its draft (offline, never imported at serve time): the corpus generator,
the data pipeline and the training loop. ``scripts/train-embedded`` runs it; docs/embedded-model.md is the card."""
