from llamagym.cli import main

main()
