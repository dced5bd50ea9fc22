"""flowertune_fedex: a FlowerTune-style LLM app, federated exactly with FedEx-LoRA."""
