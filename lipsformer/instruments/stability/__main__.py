from .experiment_command import main

main()
