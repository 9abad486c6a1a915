"""Job backends' launchers: how the job runner starts one step (`base.Launcher`), one module per backend."""
