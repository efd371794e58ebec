"""Who is calling: API keys (format, hashing), the authenticator with its key cache, the admin key,
throttles for failed lookups, key last-use recording and the client address they key on."""
