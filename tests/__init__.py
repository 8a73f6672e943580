"""The test suite; its folders mirror the packages, shared code lives in helpers/."""
