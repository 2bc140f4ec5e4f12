from kvpress_critical.analysis.cli import main

if __name__ == "__main__":
    main()
