module github.com/tessera-dev/tessera

go 1.26.0
