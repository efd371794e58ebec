"""The Responses API (POST /v1/responses and its stored responses), on the chat completions path.

A request becomes a chat request (request -> conversation), runs through the same templating, tool and
structured-output grammar, limits, engine and metering as /v1/chat/completions, and is shaped back as a
response object or its typed event stream (generation, events); stored responses live per tenant in the
platform database (store).
"""
