from loramux.cli import main

main()
