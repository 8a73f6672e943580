"""What tests share: demo engines, API clients, real serve/join processes, fixtures."""
