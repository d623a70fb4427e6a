"""An OpenAI-compatible HTTP server (`python -m apex_compile serve`)."""
