"""Texts a rebuilt tokenizer must encode as the original does: digits, unicode, whitespace
runs, code, the empty text (the GGUF tests and the real coder's tokenizer test share them)."""

CORPUS = (
    "Hello, world! The capital of France is Paris.",
    "3.14159265358979 and 1234567890123 then 1,000,000.00 or 0x1F, 2024-06-30",
    "café naïve résumé Ångström Straße ÉCOLE",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀🎉 👍🏽 👨‍👩‍👧 ✓",
    "  two leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\ttabs",
    "lines\n\n\nand\r\nCRLF",
    " \n \t \n    ",
    "def square(x):\n    return x ** 2  # power\n",
    'if (a && b) { printf("%d\\n", a[i]); }',
    "I'm sure they've said it's JSON: {\"key\": [1, 2, 3], 'DON'T': null}",
    "",
)
