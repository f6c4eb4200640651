"""The Goodput gateway: one OpenAI endpoint for every InferenceService, routing for goodput."""
