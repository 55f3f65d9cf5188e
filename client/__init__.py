"""What every client of a scheduler does: tokenizer, chat template, EOS ids, detokenizer, stop strings.

Shared by the HTTP frontend and the offline `LLM`; imports only `pagedserve.protocol`.
"""
