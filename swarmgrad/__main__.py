from swarmgrad.cli import main

main()
