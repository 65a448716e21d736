from perf.run import main

main()
