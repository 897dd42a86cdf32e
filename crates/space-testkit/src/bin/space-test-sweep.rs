//! Removes what killed tests left behind (see `space_testkit::leftovers`);
//! `scripts/test.sh` runs it after the tests, when no later test would.

fn main() {
    let swept = space_testkit::leftovers::sweep(true);
    for dir in &swept.data_dirs {
        println!("removed the data dir of a killed test: {}", dir.display());
    }
    for name in &swept.netns {
        println!("removed the network namespace of a killed test: {name}");
    }
    for dir in &swept.postgres {
        println!("removed the PostgreSQL cluster of a killed test: {}", dir.display());
    }
}
