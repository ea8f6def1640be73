"""Multi-latent attention (DeepSeek-V2/V3): flags (:mod:`.config`) and the layer (:mod:`.attention`)."""
