"""tvmflash in other libraries: each module hooks tvmflash into one (``transformers``: Hugging Face
Transformers). Importing this package imports none of them."""
