"""Entry point (also the Hugging Face Spaces app_file): python app.py --help lists every option."""

from app.main import main

if __name__ == "__main__":
    main()
