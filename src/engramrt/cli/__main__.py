from engramrt.cli import main

main()
