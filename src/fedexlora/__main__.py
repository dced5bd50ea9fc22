from fedexlora.cli import main

main()
