"""SGLang's native `/generate`: request models, conversion and response builders, routes."""
