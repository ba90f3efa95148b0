"""Data shipped with npuport: the GSM8K test and train splits (MIT, see gsm8k/README.md) and the trained tiny
model. No code lives here, so it imports nothing."""
