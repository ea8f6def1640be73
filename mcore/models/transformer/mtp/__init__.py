"""Multi-token prediction (DeepSeek-V3; megatron-core's ``MultiTokenPredictionBlock``)."""
